"""`python -m rsclip_ds ...` (the form the `deepspeed --module` launcher starts) and the
`rsclip-ds` command (setup.cfg's console script): the host allocator's switches that must be in
the environment before torch is imported, then the command line (rsclip_ds.cli)."""

import sys

from rsclip_ds.runtime.host_memory import ask_for_huge_pages   # the standard library only


def entry() -> int:
    ask_for_huge_pages(sys.argv[1:])
    from rsclip_ds.cli import main

    return main()


if __name__ == "__main__":
    sys.exit(entry())
