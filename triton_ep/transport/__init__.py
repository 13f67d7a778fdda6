"""Moving bytes between ranks: :mod:`.ipc` within one host (CUDA IPC or POSIX shared memory); the RDMA
modules (:mod:`.rdma`, :mod:`.verbs`, :mod:`.emulated`, :mod:`.topology`) between hosts."""
