"""The audit trail: records per step, roll-back at resume, and `splitrl audit` accounting for
every drawn prompt (trained once, filtered, dropped, unfinished; else trained twice or lost)."""

from __future__ import annotations

import json

from splitrl_app.cli import main as cli
from trainer_service.orchestration.audit import ROLLED_BACK, AuditLog, audit_run
from trainer_service.orchestration.rollouts import Completion, RolloutGroup, WorkItem


def groups(*seqs):
    return [RolloutGroup(WorkItem(f"p#{s}", {}, seq=s, seed=s), [1],
                         [Completion([2], [-0.1], 1.0, {}, "stop")], 0, "s0", f"r{s}")
            for s in seqs]


def checkpoint(run_dir, step, drawn, unfinished=()):
    meta = run_dir / "checkpoints" / str(step) / "meta"
    meta.mkdir(parents=True)
    cursor = {"drawn": drawn, "unfinished": [{"uid": f"p#{u}"} for u in unfinished]}
    (meta / "metadata").write_text(json.dumps({"step": step, "data_cursor": cursor}))


def test_a_clean_run_accounts_for_every_prompt(tmp_path, capsys):
    log = AuditLog(tmp_path)
    log.record(1, 0, groups(0, 1), filtered=groups(2))
    log.record(2, 1, groups(3, 4), dropped=[(groups(5)[0].item, "INVALID_ARGUMENT: too long")])
    log.close()
    checkpoint(tmp_path, 2, drawn=8, unfinished=[6, 7])
    report = audit_run(tmp_path)
    assert report.ok and (report.trained, report.filtered, report.dropped) == (4, 1, 1)
    assert report.unfinished == 2 and report.drawn == 8
    assert cli(["audit", str(tmp_path)]) == 0
    assert "lost: 0" in capsys.readouterr().out


def test_resume_rolls_back_repeated_steps_and_audit_finds_what_is_wrong(tmp_path, capsys):
    log = AuditLog(tmp_path)
    for step in (1, 2, 3):
        log.record(step, step - 1, groups(2 * step - 2, 2 * step - 1))
    log.close()
    # The trainer resumes from step 1: steps 2 and 3 will be trained again.
    assert AuditLog(tmp_path).roll_back_to(1) == 2
    moved = [json.loads(line) for line in (tmp_path / ROLLED_BACK).read_text().splitlines()]
    assert [(r["step"], r["rolled_back_to"]) for r in moved] == [(2, 1), (3, 1)]
    log = AuditLog(tmp_path)
    log.record(2, 1, groups(2, 3))
    log.record(3, 2, groups(4, 2))  # p#2 trained twice; p#5 never
    log.close()
    checkpoint(tmp_path, 3, drawn=6)
    report = audit_run(tmp_path)
    assert report.steps == [1, 2, 3] and report.rolled_back == 2
    assert report.twice == ["p#2"] and report.lost == [5] and not report.ok
    assert cli(["audit", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "trained twice: 1 e.g. ['p#2']" in out and "lost: 1 e.g. draw numbers [5]" in out
    assert cli(["audit", str(tmp_path / "missing")]) == 2
