"""The per-step view: each step of a response coloured by its PRM score, the first wrong step marked; for
multi-turn episodes, each policy turn with its reward components (`per_turn_html`).

A self-contained HTML page (no scripts, no external assets) logged to MLflow as an artifact, so the
MLflow UI shows *why* a run's accuracy moved: which steps the PRM distrusted, and where the exact
checker says the reasoning first went wrong.
"""

from __future__ import annotations

import html

from ..data import steps as steps_lib
from ...tasks import arithmetic


def score_colour(score: float) -> str:
    """The CSS colour of a step scored `score` (P(correct), clipped to [0, 1]): red (0) through yellow to green (1)."""
    score = min(max(score, 0.0), 1.0)
    red = int(255 * min(1.0, 2 * (1 - score)))
    green = int(200 * min(1.0, 2 * score))
    return f"rgb({red},{green},80)"


def per_step_html(rows: list[dict], title: str = "prmflow: per-step PRM scores") -> str:
    """rows: {prompt_id, prompt, response, correct, step_scores (list or None), source}."""
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           "<style>body{font-family:sans-serif;margin:1.5em} .case{border:1px solid #ccc;border-radius:6px;"
           "padding:.6em;margin:.8em 0} .step{font-family:monospace;padding:2px 6px;margin:2px 0;border-radius:4px;"
           "color:#111;display:block} .wrong{outline:3px solid #b00;font-weight:bold} .score{float:right;opacity:.8}"
           " .ok{color:#060} .bad{color:#b00}</style></head><body>",
           f"<h1>{html.escape(title)}</h1>",
           "<p>Each step is coloured by the PRM's probability that it is correct (red 0 &rarr; green 1). "
           "A thick red outline marks the first wrong step according to the exact checker.</p>"]
    for row in rows:
        steps = steps_lib.steps(row["response"])
        first_wrong = None
        if row.get("source") == "arithmetic":
            try:
                first_wrong = arithmetic.first_error(row["prompt"], "\n".join(steps))
            except ValueError:
                first_wrong = None
        verdict = "<span class='ok'>correct</span>" if row["correct"] else "<span class='bad'>wrong</span>"
        out.append(f"<div class='case'><b>{html.escape(row['prompt_id'])}</b> &mdash; {verdict}"
                   f"<pre>{html.escape(row['prompt'].strip())}</pre>")
        scores = row.get("step_scores") or [None] * len(steps)
        for k, (text, score) in enumerate(zip(steps, scores)):
            style = f"background:{score_colour(score)}" if score is not None else "background:#eee"
            cls = "step wrong" if k == first_wrong else "step"
            label = f"<span class='score'>{score:.3f}</span>" if score is not None else ""
            marker = " &larr; first wrong step" if k == first_wrong else ""
            out.append(f"<span class='{cls}' style='{style}'>{html.escape(text)}{marker}{label}</span>")
        if first_wrong is not None and first_wrong >= len(steps):
            out.append("<span class='step wrong' style='background:#eee'>(missing step) &larr; first wrong step</span>")
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)


def per_turn_html(episodes: list[dict], title: str = "prmflow: per-turn rewards") -> str:
    """Multi-turn episodes, one box each: the opening and observation messages in grey, each policy turn coloured
    by the PRM's score at its end (else by its step reward, clipped to [0, 1]) with its reward components.

    episodes: {prompt_id, messages, step_components (one dict per policy turn), step_rewards, turn_scores (or None),
    outcome (dict)}."""
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
           "<style>body{font-family:sans-serif;margin:1.5em} .case{border:1px solid #ccc;border-radius:6px;"
           "padding:.6em;margin:.8em 0} .turn{font-family:monospace;white-space:pre-wrap;padding:2px 6px;margin:2px 0;"
           "border-radius:4px;color:#111;display:block} .env{background:#eee;color:#444} .role{opacity:.6;"
           "margin-right:.6em} .score{float:right;opacity:.8}</style></head><body>",
           f"<h1>{html.escape(title)}</h1>",
           "<p>Grey: the environment's messages (the task, tool results). Coloured: the policy's turns, by the PRM's "
           "score at the turn's end (red 0 &rarr; green 1), or by the turn's reward when no PRM scored it; each "
           "shows its reward components.</p>"]
    for ep in episodes:
        outcome = " &middot; ".join(f"{html.escape(k)} {v:.3f}" for k, v in sorted(ep.get("outcome", {}).items()))
        out.append(f"<div class='case'><b>{html.escape(str(ep['prompt_id']))}</b> &mdash; {outcome}")
        turn = 0
        for m in ep["messages"]:
            role, text = html.escape(m["role"]), html.escape(m["content"])
            if m["role"] != "assistant":
                out.append(f"<span class='turn env'><span class='role'>{role}</span>{text}</span>")
                continue
            parts = ep["step_components"][turn] if turn < len(ep["step_components"]) else {}
            rewards, scores = ep.get("step_rewards") or [], ep.get("turn_scores") or []
            reward = rewards[turn] if turn < len(rewards) else None
            score = scores[turn] if turn < len(scores) else None
            shade = score if score is not None else reward
            style = f"background:{score_colour(shade)}" if shade is not None else "background:#ddd"
            label = " &middot; ".join([f"{html.escape(k)} {v:.2f}" for k, v in sorted(parts.items())]
                                      + ([f"reward {reward:.3f}"] if reward is not None else [])
                                      + ([f"PRM {score:.3f}"] if score is not None else []))
            out.append(f"<span class='turn' style='{style}'><span class='role'>{role} {turn + 1}</span>{text}"
                       f"<span class='score'>{label}</span></span>")
            turn += 1
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)
