"""Set-up of the environment that ``make venv`` creates: ``python -m autopar.envsetup``.

torchvision's wheel from PyPI does not import beside the CPU build of torch 2.13.0 (``operator
torchvision::nms does not exist``), and timm and parts of transformers import torchvision. The fix
(:func:`autopar.zoo.ensure_torchvision_importable`) must run before torchvision's first import
in *any* script of the environment, whether it imports autopar first, later or never. So this
command writes a ``.pth`` file into the environment's site-packages: at interpreter start-up it
puts a finder in front of ``sys.meta_path`` that does nothing until something imports
``torchvision``; then it runs the fix once, removes itself, and lets the normal import proceed.
Start-up pays for a class definition, nothing more (torch is imported only with torchvision).
"""
from __future__ import annotations

import os
import sys
import sysconfig

PTH_NAME = "autopar-torchvision.pth"

# One line (a .pth file executes lines that start with "import"): the finder described above.
_HOOK = (
    "import sys, importlib.abc; exec("
    + repr(
        "class _AutoparTorchvisionFix(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchvision':\n"
        "            sys.meta_path.remove(self)\n"
        "            try:\n"
        "                import autopar.zoo\n"
        "                autopar.zoo.ensure_torchvision_importable()\n"
        "            except Exception as err:\n"
        "                sys.stderr.write(f'autopar: torchvision fix-up failed: {err}\\n')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _AutoparTorchvisionFix())\n"
    )
    + ")\n"
)


def site_dir() -> str:
    """The running environment's site-packages (``purelib``)."""
    return sysconfig.get_paths()["purelib"]


def install(directory: str | None = None) -> str:
    """Write the start-up hook into ``directory`` (default: this environment's site-packages);
    returns the file's path. Idempotent."""
    path = os.path.join(directory or site_dir(), PTH_NAME)
    with open(path, "w") as f:
        f.write(_HOOK)
    return path


def main(argv: list[str] | None = None) -> int:
    path = install()
    print(f"autopar: torchvision import fix-up installed at start-up ({path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
