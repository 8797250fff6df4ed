"""The environment the README's commands create imports transformers and timm in any order,
with or without autopar (torchvision's wheel needs a fix-up beside the CPU torch: see
``autopar.envsetup``)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autopar import envsetup

SCRIPTS = {
    "transformers before autopar": "from transformers import LlamaForCausalLM\nimport timm\nimport autopar\n",
    "timm alone": "import timm\nm = timm.create_model('resnet18', pretrained=False, num_classes=3)\n",
    "autopar before timm": "import autopar, torch\nimport timm\nimport torchvision\n",
}


def test_hook_is_installed():
    path = os.path.join(envsetup.site_dir(), envsetup.PTH_NAME)
    assert os.path.exists(path), "the environment lacks the torchvision start-up hook: run `make venv`"


@pytest.mark.parametrize("label", sorted(SCRIPTS))
def test_user_script_imports(label):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", SCRIPTS[label] + "print('imported')"], capture_output=True,
                       text=True, env=env, cwd="/", timeout=300)
    assert r.returncode == 0 and "imported" in r.stdout, f"{label}:\n{r.stderr[-2000:]}"


def test_install_is_idempotent(tmp_path):
    a = envsetup.install(str(tmp_path))
    b = envsetup.install(str(tmp_path))
    assert a == b and open(a).read().startswith("import ")
    assert len(os.listdir(tmp_path)) == 1
