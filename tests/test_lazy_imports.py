"""`import minserve` and the commands that need no engine do not load PyTorch (minserve/lazy.py).

Each check runs in a fresh interpreter: this test process has long since imported torch.
"""

import json
import subprocess
import sys

import pytest


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it leaves a dict in ``out``, printed as JSON."""
    done = subprocess.run([sys.executable, "-c", f"import json, sys\nout = {{}}\n{code}\nprint(json.dumps(out))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", [["--help"], ["bench", "serve", "--help"], ["bench", "sweep", "--help"],
                                     ["gate", "--help"], ["serve", "--help"], ["eval", "--help"]])
def test_commands_that_need_no_engine_leave_torch_unloaded(command):
    out = _fresh("import contextlib, io\nfrom minserve.cli import main\n"
                 "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
                 f"    try:\n        main({command!r})\n    except SystemExit:\n        pass\n"
                 "out['usage'] = 'usage' in text.getvalue()\nout['torch'] = 'torch' in sys.modules")
    assert out == {"usage": True, "torch": False}


def test_importing_the_packages_leaves_torch_unloaded_until_a_name_is_used():
    out = _fresh("import minserve, minserve.eval, minserve.models\nfrom minserve.eval.data import dataset_path\n"
                 "from minserve.models.loader import resolve_model_dir\n"
                 "out['before'] = 'torch' in sys.modules\nfrom minserve import SamplingParams, LLM\n"
                 "out['after'] = 'torch' in sys.modules\nout['same'] = minserve.LLM is LLM\n"
                 "import minserve.engine.llm as home\nout['home'] = home.LLM is LLM")
    assert out == {"before": False, "after": True, "same": True, "home": True}


def test_every_exported_name_resolves_to_its_home_and_unknown_names_fail():
    import minserve
    import minserve.eval
    import minserve.models
    for package in (minserve, minserve.eval, minserve.models):
        for name in package.__all__:
            value = getattr(package, name)
            home = getattr(value, "__module__", None)   # a class or function; a table has none
            assert home is None or getattr(sys.modules[home], name) is value, f"{package.__name__}.{name}"
            assert name in dir(package)
    with pytest.raises(AttributeError, match="module 'minserve' has no attribute 'Nope'"):
        minserve.Nope
    with pytest.raises(ImportError):
        exec("from minserve.models import Nope", {})
