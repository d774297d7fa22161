"""Distillation from a frozen teacher dual encoder (open_clip's ``--distill-model``).

    config.py   the ``distill`` section (torch-free: rsclip_ds.config imports it)
    loss.py     soft cross-entropy between teacher and student logits over the global batch,
                with its single-process reference twin
    teacher.py  the frozen teacher (a SigLIP or CLIP folder / hub id), its inputs, the Distiller
                the train steps call
    data.py     the teacher's view of a sample: same crop, the teacher's size and tokenizer

Nothing here is imported at package import time: ``import rsclip_ds.config`` stays torch-free.
"""
