"""``PREFIX.manifest.json``: the receipt of a published dataset.

What went in and what came out, unit by unit: the input (path, byte range), its size and
modification time, documents, tokens, every bad record skipped (where and why) and the
seconds it took; and the totals. ``plan`` is the digest of the settings and units, which a
rerun compares to know the dataset is up to date.
"""

from __future__ import annotations

from dataclasses import asdict

from megatron_lns.data.preprocess_plan import Settings, Unit


def manifest(settings: Settings, digest: str, units: list[Unit], receipts: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in receipts)
    documents = sum(r["documents"] for r in receipts)
    return {
        "plan": digest,
        "settings": {k: v for k, v in asdict(settings).items() if k != "inputs"},
        "totals": {
            "inputs": len(settings.inputs),
            "units": len(units),
            "input_bytes": sum(u.bytes for u in units),
            "documents": documents,
            "tokens": sum(r["tokens"] for r in receipts),
            "bad_records": sum(len(r["bad_records"]) for r in receipts),
            "unit_seconds": round(seconds, 3),
        },
        "units": [
            {
                "input": unit.describe(),
                "size": unit.size,
                "mtime_ns": unit.mtime_ns,
                **{k: v for k, v in receipt.items() if k != "unit"},
            }
            for unit, receipt in zip(units, receipts, strict=True)
        ],
    }
