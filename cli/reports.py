"""What ``--json`` prints: one explicit builder per command's output.

These dicts are a public interface, specified in docs/cli.md and
docs/cli.schema.json (the tests validate every command's output against the
schema). They are built field by field, never from a dataclass's ``__dict__``,
so that renaming a field inside the library cannot change what scripts read.
New keys may appear; existing keys keep their name, type and meaning.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcdn.catalog import DocumentSummary
    from kvcdn.check import StoreCheck
    from kvcdn.cluster import CorpusReport
    from kvcdn.errors import KvcdnError
    from kvcdn.gc import Collection, Removal
    from kvcdn.manifest import Manifest, ObjectRef
    from kvcdn.model_cache import CachedModel
    from kvcdn.publish import PublishResult, RefreshResult
    from kvcdn.sdk import BlendReport, LoadPlan
    from kvcdn.sdk.edges import WarmOutcome
    from kvcdn.signing import PublicKey, Signer


def signer(s: Signer | None) -> dict[str, Any] | None:
    return None if s is None else s.to_json()


def published(r: PublishResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "version": r.version,
        "manifest_key": r.manifest_key,
        "unchanged": r.unchanged,
        "token_count": r.token_count,
        "chunks": r.chunks,
        "uploaded_objects": r.uploaded_objects,
        "reused_objects": r.reused_objects,
        "uploaded_bytes": r.uploaded_bytes,
        "level_bytes": dict(r.level_bytes),
        "seconds": dict(r.seconds),
        "signed_by": list(r.signed_by),
        "prefilled_tokens": r.prefilled_tokens,
        "prefix_from": r.prefix_from,
        "full_prefill_reason": r.full_prefill_reason,
    }


def refreshed(done: list[RefreshResult], failed: list[tuple[str, KvcdnError]]) -> dict[str, Any]:
    """``kvcdn refresh``: the pointers renewed, and the documents that could not be."""
    return {
        "refreshed": [
            {
                "name": r.name,
                "version": r.version,
                "previous_version": r.previous_version,
                "expires": r.expires_text,
                "signed_by": list(r.signed_by),
            }
            for r in done
        ],
        "failed": [
            {"name": name, "error": str(exc), "exit_code": exc.exit_code} for name, exc in failed
        ],
    }


def corpus(report: CorpusReport) -> dict[str, Any]:
    """``kvcdn publish --ray``: every document's outcome, and how the run went."""
    return {
        "published": [
            {**published(o.result), "source": o.document.source, "attempts": o.attempts,
             "actor": o.actor, "seconds_in_actor": o.seconds}
            for o in report.outcomes if o.result is not None
        ],
        "failed": [
            {"name": o.document.name, "source": o.document.source, "error": o.error or "",
             "attempts": o.attempts}
            for o in report.failed
        ],
        "actors": report.actors,
        "actor_restarts": report.actor_restarts,
        "threads": report.threads,
        "gpus_per_actor": report.gpus_per_actor,
        "setup_s": report.setup_s,
        "seconds": report.seconds,
    }  # fmt: skip


def calibrated(
    model: str, ref: ObjectRef, levels: dict[str, dict[str, float]], calibration: dict[str, Any]
) -> dict[str, Any]:
    return {
        "model": model,
        "profile": {"key": ref.key, "bytes": ref.bytes, "sha256": ref.sha256},
        "levels": {name: dict(q) for name, q in levels.items()},
        "calibration": dict(calibration),
    }


def listing(docs: list[DocumentSummary], pointers: dict[str, int | None]
            ) -> list[dict[str, Any]]:  # fmt: skip
    """``kvcdn ls``: each document's listed versions, the one its pointer names, and the
    latest: what a reader loads (the pointer's, else the highest listed)."""
    return [{"name": d.name, "versions": list(d.versions),
             "latest": pointers[d.name] or d.latest, "pointer": pointers[d.name]}
            for d in docs]  # fmt: skip


def removed(removal: Removal, dry_run: bool) -> dict[str, Any]:
    """What ``kvcdn rm`` removed (would remove, with ``dry_run``)."""
    return {
        "dry_run": dry_run,
        "versions": list(removal.versions),
        "keys": list(removal.keys),
        "bytes": removal.bytes,
    }


def collected(report: Collection) -> dict[str, Any]:
    """What ``kvcdn gc`` deleted (would delete, with ``dry_run``) and kept."""
    return {
        "dry_run": report.dry_run,
        "grace_s": report.grace_s,
        "removed": removed(report.removal, report.dry_run),
        "versions_kept": report.manifests,
        "referenced": report.referenced,
        "deleted": list(report.deleted),
        "freed_bytes": report.freed_bytes,
        "kept_young": report.kept_young,
        "kept_young_bytes": report.kept_young_bytes,
        "kept_freshened": report.kept_freshened,
        "seconds": report.seconds,
    }


def inspected(m: Manifest) -> dict[str, Any]:
    """The manifest as docs/manifest.md specifies it, and who signed it."""
    return {**m.to_json(), "signed_by": signer(m.signer)}


def load(plan: LoadPlan) -> dict[str, Any]:
    """How one document's KV was loaded."""
    return {
        "quality": plan.level,
        "levels": dict(Counter(plan.chunk_levels)),
        "mean_quality": plan.mean_quality,
        "bytes": plan.bytes,
        "sources": dict(Counter(plan.chunk_sources)),
        "seconds": dict(plan.seconds),
        "deadline_s": plan.deadline_s,
        "predicted_ttft_s": plan.predicted_ttft_s,
        "ready_s": plan.ready_s,
        "feasible": plan.feasible,
        "replans": plan.replans,
        "cancelled_fetches": plan.cancelled,
        "rejected": list(plan.rejected),
        "chunks": [
            {
                "index": c.index,
                "tokens": c.tokens,
                "level": c.level,
                "source": c.source,
                "bytes": c.bytes,
                "start_s": c.start_s,
                "ready_s": c.ready_s,
                "quality": c.quality,
                "abandoned": list(c.abandoned),
                "failed": list(c.failed),
            }
            for c in plan.chunks
        ],
    }


def blend(report: BlendReport) -> dict[str, Any]:
    return {
        "tokens": report.tokens,
        "reused": report.reused,
        "recomputed": report.recomputed,
        "computed": report.computed,
        "recompute_ratio": report.recompute_ratio,
        "chosen_for_question": report.query > 0,
        "seconds": report.seconds,
    }


def asked(
    question: str,
    manifests: list[Manifest],
    plans: list[LoadPlan],
    *,
    answer: Any,
    ready_s: float,
    blend_report: BlendReport | None,
    prefill: Any | None,
) -> dict[str, Any]:
    """``kvcdn ask``: the same shape for one document and for several."""
    ttft_s = ready_s + answer.ttft_s
    return {
        "question": question,
        "documents": [
            {
                "ref": f"{m.name}@{m.version}",
                "name": m.name,
                "version": m.version,
                "signed_by": signer(m.signer),
                "load": load(p),
            }
            for m, p in zip(manifests, plans, strict=True)
        ],
        "kvcdn": {
            "answer": answer.text,
            "ttft_s": ttft_s,
            "ready_s": ready_s,
            "blend": None if blend_report is None else blend(blend_report),
        },
        "prefill": None if prefill is None else {"answer": prefill.text, "ttft_s": prefill.ttft_s},
        "speedup": None if prefill is None else prefill.ttft_s / ttft_s,
        "same_answer": None if prefill is None else prefill.token_ids == answer.token_ids,
    }


def warmed(outcomes: list[WarmOutcome], seconds: float) -> dict[str, Any]:
    rows = []
    for o in outcomes:
        job = o.job
        rows.append(
            {
                "edge": o.assignment.edge,
                "documents": list(o.assignment.documents),
                "objects": len(o.assignment.keys),
                "bytes": o.assignment.bytes,
                "state": o.state,
                "job": job.id if job else None,
                "cached": job.cached if job else 0,
                "fetched": job.fetched if job else 0,
                "failed": job.failed if job else 0,
                "bytes_fetched": job.bytes_fetched if job else 0,
                "errors": [{"error": o.error}] if o.error else list(job.errors if job else []),
            }
        )
    return {"edges": rows, "seconds": seconds, "ok": all(o.ok for o in outcomes)}


def key_made(path: Path, public: PublicKey) -> dict[str, Any]:
    return {"private_key": str(path), **public_key(public)}


def public_key(k: PublicKey) -> dict[str, Any]:
    return {"id": k.id, "public_key": k.text, "name": k.comment}


def public_keys(keys: list[PublicKey]) -> list[dict[str, Any]]:
    return [public_key(k) for k in keys]


def cached_models(cached: list[CachedModel]) -> list[dict[str, Any]]:
    return [
        {
            "folder": c.key,
            "path": str(c.path),
            "model": c.name,
            "source_file": c.source_file,
            "source_sha256": c.source_sha256,
            "bytes": c.bytes,
            "created_at": c.created_at,
            "complete": c.complete,
        }
        for c in cached
    ]


def store_check(report: StoreCheck) -> dict[str, Any]:
    """``kvcdn check``: what was checked, what is wrong, and the orphans."""
    return {
        "store": report.store,
        "ok": report.ok,
        "whole_store": report.whole_store,
        "documents": report.documents,
        "versions": report.versions,
        "objects": report.objects,
        "bytes_read": report.bytes_read,
        "problems": [
            {"key": p.key, "kind": p.kind, "detail": p.detail, "used_by": list(p.used_by)}
            for p in report.problems
        ],
        "orphans": list(report.orphans),
        "orphan_bytes": report.orphan_bytes,
        "seconds": report.seconds,
    }
