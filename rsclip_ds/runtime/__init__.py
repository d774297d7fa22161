"""The process runtime, where the side effects live: the process group and logging
(distributed), the liveness watch between ranks (heartbeat), the shared-storage checks of a
multi-node output folder (storage) and the host allocator's settings (host_memory)."""
