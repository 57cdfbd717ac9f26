"""The training benchmark's checks: every backend's loss curve and final loss against eager's,
each bound at least the row's rounding spread (eager's rounding references, eager channels_last),
and eager's final loss as the mean over its own trainings."""
from __future__ import annotations

from typing import Any, Dict, List

from .trainee import Trainee, _finish, _guarded

def _rounding_references(base, batches, tasks, eager: Trainee, a, errors: List[str]) -> List[Dict[str, Any]]:
    """``a.rounding_references`` runs of eager whose gradients are perturbed by one rounding of the
    loop's precision at every step (``TrainLoop(grad_noise=...)``, one seed each), untimed, as many
    steps as the loss checks read (and the learning task): how far rounding alone moves eager's loss
    curve from eager's. The largest of their distances (and eager channels_last's) bounds every
    backend's."""
    from fxopt.testing.training import AMP_DTYPES, UNIT_ROUNDOFF

    eps = UNIT_ROUNDOFF[AMP_DTYPES[a.amp]]
    out = []
    for k in range(1, a.rounding_references + 1):
        t = Trainee("eager", base, batches, a.device, a.amp, a.lr, seed=a.seed, grad_noise=(eps, a.seed + k))
        _guarded(t, lambda: t.steps(a.losses), errors, f"rounding reference {k}")
        if a.final_steps:
            _guarded(t, lambda: t.converge(base, tasks), errors, f"rounding reference {k}, learning tasks")
        cell = _finish(t, eager, a, 0)
        out.append({"grad_noise": eps, "noise_seed": a.seed + k, "status": cell["status"],
                    **{key: cell.get(key) for key in ("losses_max_rel_diff", "final_loss", "final_loss_rel_diff")
                       if key in cell}})
    return out


def _eager_mean_final(cells: List[Dict[str, Any]]) -> None:
    """Eager's final loss as the mean over its trainings: eager's own and its rounding references'
    (each an equally valid eager training: one rounding per step apart, as eager on another
    device or with another cuDNN algorithm would be). One chaotic training's final loss is one draw;
    the mean of several is what eager reaches. Every backend's final loss gets its distance from
    that mean (``final_loss_rel_diff_eager_mean``), and eager's cell how far its own trainings lie
    from it (``eager_trainings_rel_diff``)."""
    eager = next((c for c in cells if c["backend"] == "eager" and c.get("final_loss") is not None), None)
    if eager is None:
        return
    runs = [eager["final_loss"]] + [r["final_loss"] for r in eager.get("rounding_references") or []
                                    if r.get("status") == "ok" and r.get("final_loss") is not None]
    if len(runs) < 2:
        return
    mean = sum(runs) / len(runs)
    eager["eager_mean_final_loss"], eager["eager_final_trainings"] = mean, len(runs)
    eager["eager_trainings_rel_diff"] = [abs(x - mean) / abs(mean) for x in runs]
    for c in cells:
        if c is not eager and c.get("final_loss") is not None:
            c["eager_mean_final_loss"] = mean
            c["final_loss_rel_diff_eager_mean"] = abs(c["final_loss"] - mean) / abs(mean)


def _checks(cells: List[Dict[str, Any]], tol: float) -> List[Dict[str, Any]]:
    """Per non-eager backend that ran: first losses within ``tol`` of eager's, the final loss within
    5%, and (fxopt) no fallback. Each bound is at least the row's rounding spread: the largest
    distance from eager of eager's rounding references (eager with every gradient perturbed by one
    rounding of the precision, per seed) and of ``eager-channels-last`` where it ran (other cuDNN
    kernels, other rounding). Training amplifies rounding at every optimizer step, so a curve that
    differs from eager's only in rounding lands anywhere inside that spread; ``tol`` in a check
    says which bound applied."""
    spread: Dict[tuple, tuple] = {}  # row -> largest reference distance from eager (first losses, final loss)

    def widen(key, c):
        first, final = spread.get(key, (0.0, 0.0))
        spread[key] = (max(first, c.get("losses_max_rel_diff") or 0.0), max(final, c.get("final_loss_rel_diff") or 0.0))

    for c in cells:
        key = (c["model"], c["batch"], c["dtype"])
        if c["backend"] == "eager-channels-last" and c["status"] == "ok":
            widen(key, c)
        for ref in c.get("rounding_references") or []:
            if ref["status"] == "ok":
                widen(key, ref)
    out = []
    for c in cells:
        if c["backend"] == "eager" or c["status"] == "skipped":
            continue
        if c["backend"] == "eager-channels-last" and c["status"] != "ok":
            continue  # a reference, not a compiler under test (a model may not run in channels_last)
        chk = {k: c[k] for k in ("model", "batch", "dtype", "backend")}
        first_spread, final_spread = spread.get((c["model"], c["batch"], c["dtype"]), (0.0, 0.0))
        row_tol = max(tol, first_spread)
        chk["tol"] = row_tol
        problems = []
        if c["status"] != "ok":
            problems.append(f"did not run: {c.get('error')}")
        elif c.get("losses_max_rel_diff") is None:
            problems.append("no loss comparison (eager did not run)")
        elif not c["losses_max_rel_diff"] <= row_tol:
            problems.append(f"losses differ from eager's by {c['losses_max_rel_diff']:.3g} > {row_tol:g}")
        final_tol = max(c.get("final_loss_tol") or 0.0, final_spread)
        if c.get("final_loss_rel_diff") is not None:
            chk["final_tol"] = final_tol
        if c.get("final_loss_rel_diff") is not None and not c["final_loss_rel_diff"] <= final_tol:
            problems.append(f"final loss {c['final_loss']:.4f} vs eager {c['eager_final_loss']:.4f}")
        if (c.get("fxopt") or {}).get("fallbacks") or c.get("fallback"):
            problems.append(f"fxopt fell back: {((c.get('fxopt') or {}).get('fallbacks') or [c.get('fallback')])[0]}")
        chk["ok"] = not problems
        if problems:
            chk["reason"] = "; ".join(problems)
        out.append(chk)
    return out
