"""``megatron-lns status RUN_DIR``: where a run is and where its wall time went (its
goodput), read from the run directory alone (:mod:`megatron_lns.training.run_report`;
imports no torch, so it answers at once on a login node while the run trains)."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser(
        "status", help="where a run is (step, tokens, checkpoint, restarts) and its goodput"
    )
    status.add_argument("run_dir", help="the run directory: <exp_manager.exp_dir>/<name>")
    status.add_argument("--json", action="store_true", help="print the report as JSON")
    status.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from megatron_lns.cluster.slurm.queued import not_started_line, queued_submission
    from megatron_lns.training.run_report import run_report

    if queued := queued_submission(Path(args.run_dir)):
        script, job_id = queued
        if args.json:  # job_id as in a started run's attempt_list; null where unrecorded
            report = {"run_dir": args.run_dir, "state": "not started", "job_id": job_id}
            print(json.dumps(report | {"job_script": str(script)}, indent=2))
        else:
            print(not_started_line(Path(args.run_dir), script, job_id))
        return 0
    report = run_report(args.run_dir)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print("\n".join(report.lines()))
    return 0
