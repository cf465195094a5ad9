"""Sizes in tables (8 B, 64 KiB, 1 MiB) and on command lines (8, 4K, 1M, 1G), and lists of names."""
import argparse


def size_name(s, gib=False):
    """'8 B', '4 KiB', '64 MiB' (and with gib, '1 GiB'): the largest unit that divides s."""
    units = (("GiB", 30),) if gib else ()
    for unit, shift in units + (("MiB", 20), ("KiB", 10)):
        if s >= 1 << shift and s % (1 << shift) == 0:
            return f"{s >> shift} {unit}"
    return f"{s} B"


def parse_size(text):
    """'8' -> 8, '4K' -> 4096, '1M', '1G' (binary units, either case)."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


def parse_list(parser, flag, text, allowed):
    """A comma-separated list of distinct items of `allowed`, or parser.error naming the flag."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items or len(set(items)) != len(items):
        parser.error(f"{flag}: want distinct items of {','.join(allowed)}, got '{text}'")
    return items


def positive(text):
    """An argparse type: a count of 1 or more (a run of no launches or rounds has no median)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return n
