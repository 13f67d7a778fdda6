"""setuptools hook for one file: ``triton_ep_deep_ep.pth`` goes to the root of the wheel (site-packages), where
Python's ``site`` runs it at start-up (the opt-in ``deep_ep`` import hook, triton_ep/deep_ep_hook.py). Everything
else about the package is in pyproject.toml."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "triton_ep_deep_ep.pth"


class build_py_with_pth(build_py):
    """``build_py`` that also copies ``triton_ep_deep_ep.pth`` to the top of the build tree (the wheel's root).
    In an editable install (PEP 660, setuptools >= 64: ``editable_mode``) the build tree is thrown away and the
    editable wheel is assembled in ``install``'s ``install_lib``, so the file goes there instead."""

    def _pth_target(self):
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        return os.path.join(root, PTH)

    def run(self):
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), self._pth_target(),
                       preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
