"""``areal-npu train --launcher {local,ray}``: bad values exit 2 naming the option, ``--dry-run``
prints the plan and the Ray placement groups without importing (let alone starting) Ray, and a
real run hands the recipe to the Ray launcher's entry. No Ray cluster here (tests/launch/test_ray_launch.py
runs one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from areal_npu import cli

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml"


def test_bad_launcher_value_exits_2_naming_the_option():
    out = subprocess.run(
        [sys.executable, "-m", "areal_npu.cli", "train", str(QUICKSTART), "--launcher", "slurm"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--launcher" in out.stderr and "slurm" in out.stderr and "Traceback" not in out.stderr


def test_ray_address_without_ray_launcher_is_a_config_error(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\n")
    assert cli.main(["train", str(recipe), "--ray-address", "10.0.0.1:6379"]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("config error: --ray-address: ")


# runs the CLI, then reports on stderr's last line whether anything imported Ray
_PROBE = (
    "import json, sys\nfrom areal_npu.cli import main\nrc = main(sys.argv[1:])\n"
    "print(json.dumps({'rc': rc, 'ray_imported': 'ray' in sys.modules}), file=sys.stderr)\n"
)


def test_ray_dry_run_prints_the_plan_and_its_groups_without_ray():
    argv = ["train", str(QUICKSTART), "--launcher", "ray", "--dry-run", "--json", "--devices-per-node", "6"]
    out = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300)
    probe = json.loads(out.stderr.strip().splitlines()[-1])
    assert probe == {"rc": 0, "ray_imported": False}, out.stderr
    plan = json.loads(out.stdout)
    # the reference: one group per node, one bundle per process asking for its cores (no sharing here)
    expected = [
        [{"CPU": float(len(p["devices"]))} for p in plan["processes"] if p["node"] == node]
        for node in range(plan["nodes"])
    ]
    assert plan["ray_placement_groups"] == expected
    assert sum(b["CPU"] for g in expected for b in g) == 6  # the whole node is reserved


def test_ray_dry_run_text_lists_the_groups(capsys):
    argv = [
        "train",
        str(QUICKSTART),
        "--launcher",
        "ray",
        "--dry-run",
        "--devices-per-node",
        "4",
        "--verbose",
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "Ray placement groups" in text and "node 0: [" in text
    assert cli.main(["train", str(QUICKSTART), "--dry-run", "--devices-per-node", "4"]) == 0
    assert "Ray placement groups" not in capsys.readouterr().out  # the local launcher has none


def test_ray_launcher_runs_the_ray_launch_entry_with_the_recipe(tmp_path, monkeypatch):
    from areal_npu.launch import ray_launch

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\n")
    calls = []
    monkeypatch.setattr(ray_launch, "main", lambda argv: calls.append(argv) or 7)  # no Ray here
    argv = ["train", str(recipe), "seed=3", "--launcher", "ray", "--ray-address", "10.0.0.1:6379", "--resume"]
    assert cli.main(argv) == 7  # the launcher's exit code is the command's
    assert calls == [[str(recipe), "seed=3", "--address", "10.0.0.1:6379", "--resume"]]
    assert ray_launch._parser().parse_args(calls[0]).resume  # the entry accepts what it is handed
