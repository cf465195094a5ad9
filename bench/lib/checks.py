"""Verdicts: a performance target's record (met / missed / not measured; a missed target is
reported, never a failure) and the #wrong cell of a table row (wrong results always fail a run)."""


def target(name, have, limit, ok, text):
    """The record of one target: ok(have, limit) decides; text is formatted with have and limit."""
    if have is None or limit is None:
        return {"target": name, "status": "not measured"}
    return {"target": name, "status": "met" if ok(have, limit) else "missed",
            "value": have, "limit": limit, "text": text.format(have=have, limit=limit)}


def wrong_cell(counts, only_wrong):
    """The #wrong cell from {label: wrong count, None when not measured}: "0" when every measured
    count is 0, "-" when none was measured, else "label count, ..." (only the wrong ones with
    only_wrong, else every label, "-" for the unmeasured)."""
    if all(c in (0, None) for c in counts.values()):
        return "0" if any(c == 0 for c in counts.values()) else "-"
    return ", ".join(f"{k} {c if c is not None else '-'}" for k, c in counts.items()
                     if c or not only_wrong)
