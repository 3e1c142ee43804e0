"""Time partitions of a log (``data.partitions``): ``data.train_path`` is a directory of
partition directories named by their time (``day=2026-11-26/``, Hive's layout, which Spark
and most feature stores write), each holding that period's ``*.parquet`` files.

``list_partitions`` finds them and orders them by the time their names say, not by the
names' bytes (``hour=9`` before ``hour=10``). What it refuses or leaves out, each in one line:

- a directory whose name does not match the pattern (``day=2026-13-45``, ``day=yesterday``):
  refused when the run starts (a partition that cannot be ordered cannot be trained in
  order); when following, warned once and left out;
- two names that say the same time (``day=2026-11-04`` and ``day=2026-11-4``), or two
  partitions holding the same file (a link): refused;
- with ``ready_marker`` (Spark's ``_SUCCESS``), a partition without it: still being written,
  left out until it has it, so a reader never sees half a partition (continuous training
  also stops before it when a later partition is complete: ``hybridrec.training.continuous``);
- a partition without rows: kept (it is a day that happened), trained on for no step and
  reported with 0 rows.

Files starting with ``.`` or ``_`` (markers, writers' temporaries) are not data, as Spark and
PyArrow's dataset reader also treat them. Ordering rules across time (a partition that arrives
after later ones were trained) are the trainer's (``hybridrec.training.continuous``), which knows the
position; here a listing is a snapshot of the directory.
"""

from __future__ import annotations

import datetime as dt
import glob
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

from hybridrec.data import DataError, missing_hint

log = logging.getLogger("hybridrec.data.parquet")

# strftime codes a pattern may use: enough for day and hour partitions, and each one matches
# a run of digits, so the name can be parsed back without ambiguity.
_CODES = {"%Y": r"(?P<Y>\d{4})", "%m": r"(?P<m>\d{1,2})", "%d": r"(?P<d>\d{1,2})", "%H": r"(?P<H>\d{1,2})"}


@dataclass(frozen=True)
class Partition:
    name: str
    """The directory's name (``day=2026-11-26``)."""
    time: dt.datetime
    """The time its name says: partitions are read in this order."""
    files: tuple[str, ...]
    """Its Parquet files, in name order."""


def pattern_regex(pattern: str, key: str = "data.partitions.pattern") -> re.Pattern:
    """The regular expression of a partition name pattern, or a ValueError naming the key."""
    if not pattern or "/" in pattern or os.sep in pattern:
        raise ValueError(f"{key}={pattern!r}: a directory name with strftime codes, like 'day=%Y-%m-%d'")
    parts, i = [], 0
    for m in re.finditer(r"%.", pattern):
        if m.group() not in _CODES:
            raise ValueError(
                f"{key}={pattern!r}: {m.group()} is not supported; use {', '.join(_CODES)} (year, month, day, hour)"
            )
        parts.append(re.escape(pattern[i : m.start()]))
        parts.append(_CODES[m.group()])
        i = m.end()
    parts.append(re.escape(pattern[i:]))
    codes = re.findall(r"%.", pattern)
    if "%Y" not in codes or len(codes) != len(set(codes)):
        raise ValueError(f"{key}={pattern!r}: needs %Y, and each code at most once (the names must say a time)")
    return re.compile("".join(parts))


def parse_name(name: str, regex: re.Pattern) -> Optional[dt.datetime]:
    """The time a partition name says, or None when it does not match or is no real time."""
    m = regex.fullmatch(name)
    if not m:
        return None
    g = m.groupdict()
    try:
        return dt.datetime(int(g["Y"]), int(g.get("m") or 1), int(g.get("d") or 1), int(g.get("H") or 0))
    except ValueError:  # day=2026-13-45
        return None


def parse_until(value: str, regex: re.Pattern) -> Optional[dt.datetime]:
    """``data.partitions.train_until``: a partition name (``day=2026-11-07``) or an ISO date
    or time (``2026-11-07``, which needs no quoting on Hydra's command line); None if neither."""
    time = parse_name(value, regex)
    if time is None:
        try:
            time = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    return time


def list_partitions(
    root: str,
    pattern: str,
    ready_marker: Optional[str] = None,
    strict: bool = True,
    warned: Optional[set[str]] = None,
    unready: Optional[list[Partition]] = None,
) -> list[Partition]:
    """The complete partitions under ``root`` in time order (see the module docstring).
    ``strict``: a malformed name is a DataError; otherwise it is warned about (once per name,
    recorded in ``warned``) and left out. ``unready``: receives the partitions left out for
    want of ``ready_marker``, in time order (their files are not listed)."""
    key = "data.train_path"
    if not os.path.isdir(root):
        raise DataError(f"{key}={root}: not a directory of partitions (data.partitions is set){missing_hint(root)}")
    regex = pattern_regex(pattern)
    warned = set() if warned is None else warned
    found: dict[dt.datetime, Partition] = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith((".", "_")) or not os.path.isdir(path):
            continue  # markers and temporaries beside the partitions
        time = parse_name(name, regex)
        if time is None:
            why = (
                f"{os.path.join(root, name)}: the partition name does not match data.partitions.pattern="
                f"{pattern!r} (or is no real time)"
            )
            if strict:
                raise DataError(f"{why}: rename it, move it out of {root}, or set the pattern its names follow")
            if name not in warned:
                warned.add(name)
                log.warning(f"data: {why}; left out")
            continue
        if time in found:
            raise DataError(
                f"{path} and {os.path.join(root, found[time].name)} name the same time ({time}): "
                f"one partition per time; merge or remove one"
            )
        if ready_marker and not os.path.exists(os.path.join(path, ready_marker)):
            if unready is not None:  # not complete yet: read once its writer leaves the marker
                unready.append(Partition(name, time, ()))
            continue
        files = tuple(
            sorted(
                p
                for p in glob.glob(os.path.join(path, "*.parquet"))
                if os.path.isfile(p) and not os.path.basename(p).startswith((".", "_"))
            )
        )
        found[time] = Partition(name, time, files)
    listed = [found[t] for t in sorted(found)]
    if unready is not None:
        unready.sort(key=lambda p: p.time)
    owner: dict[str, str] = {}
    for p in listed:  # a partition linked to another's files (or a copy made by a link) trains them twice
        for f in p.files:
            real = os.path.realpath(f)
            if real in owner:
                raise DataError(
                    f"{f} is also {owner[real]}: two partitions hold the same file (a link); a day's "
                    f"rows are trained on once: remove the duplicate"
                )
            owner[real] = f
    return listed
