"""``python -m triton_ep.scheduler``, the old name of the scheduler's command: it runs
:mod:`triton_ep.scheduler_cli` as ``__main__`` (by name: the scheduler never imports its command)."""
import runpy

runpy.run_module("triton_ep.scheduler_cli", run_name="__main__", alter_sys=True)
