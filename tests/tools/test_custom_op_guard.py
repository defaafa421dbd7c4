"""conftest's guard: a train_gpt.py executed a second time in a process registers its custom ops again and torch
drops the first module's registrations (its ops would then call freed operators: CI's "vector::reserve" failures
of stop 88); replaced_custom_ops names them, so the test that did it fails, not a later one."""
import os
import subprocess
import sys

from helpers import ROOT, TESTS

CHECK = """
import importlib.util, sys
import conftest, train_gpt
assert conftest.replaced_custom_ops() == [], conftest.replaced_custom_ops()
ours = sorted(op._qualname for op in vars(train_gpt).values() if isinstance(op, conftest.CustomOpDef))
spec = importlib.util.spec_from_file_location("second_train_gpt", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
print(len(ours), sorted(conftest.replaced_custom_ops()) == ours)
"""


def test_a_second_train_gpt_in_the_process_is_named_by_the_guard():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CHECK, os.path.join(ROOT, "train_gpt.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, all_named = proc.stdout.split()
    assert int(count) >= 10 and all_named == "True"
