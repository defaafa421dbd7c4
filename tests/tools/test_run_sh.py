"""run.sh's own checks before anything runs: NGPU and SMOKE take a few values, and a bad one is one
`error:` line. A fake `python` first on PATH shows which command run.sh would start, in no time."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_sh(tmp_path, *args, **variables):
    """run.sh's (exit code, stdout, stderr lines) with variables set; `python` prints what it was given."""
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\necho "python $*"\nexit 3\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "SMOKE")}
    env.update(variables, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", os.path.join(ROOT, "run.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=30)
    return proc.returncode, proc.stdout, proc.stderr.splitlines()


def test_ngpu_is_1_2_4_or_8(tmp_path):
    for value in ("abc", "3", "16", "0", " 8"):
        error = f"error: NGPU={value}: use NGPU=1, 2, 4 or 8 (the GPUs of this node to train on; default 8)"
        assert run_sh(tmp_path, NGPU=value) == (1, "", [error])
    for value in ("1", "8", ""):  # empty: the default, 8
        assert run_sh(tmp_path, NGPU=value) == (3, "python train_gpt.py --check\n", [])


def test_smoke_takes_the_usual_true_and_false_words(tmp_path):
    for word in ("1", "true", "YES", "On"):
        assert run_sh(tmp_path, "--cache-dir", "c", SMOKE=word) == (3, "python data/smoke/preset.py --cache-dir c\n",
                                                                    [])
    for word in ("0", "False", "no", "OFF", ""):
        assert run_sh(tmp_path, SMOKE=word) == (3, "python train_gpt.py --check\n", [])
    assert run_sh(tmp_path) == (3, "python train_gpt.py --check\n", [])  # unset
    for word in ("yes please", "2", "y"):
        assert run_sh(tmp_path, SMOKE=word) == (1, "", [
            f"error: SMOKE={word}: use SMOKE=1, true, yes or on for the smoke preset, or 0, false, no, off or empty "
            "for the speedrun"])


def test_usage_names_the_values(tmp_path):
    status, out, err = run_sh(tmp_path, "--help")
    assert status == 0 and err == [] and "NGPU=1|2|4|8" in out
    assert ("SMOKE: 1, true, yes or on runs the smoke preset (data/smoke/preset.py); 0, false, no, off or empty "
            "(the default) runs the speedrun") in " ".join(out.split())
