"""The data config as plain values: ``_plain`` (a config node as Python, enums as their
values) and the dense (``_Dense``) and sparse (``_Sparse``) features it lists."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf


def _value(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def _plain(node: Any) -> Any:
    """A config node (DictConfig, ListConfig, dict, list) as plain Python, enums as their values."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return _value(node)


# ---------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class _Dense:
    column: str
    transform: str
    mean: Optional[float]
    std: Optional[float]
    encoding: str = "scalar"
    buckets: int = 16
    knots: Optional[tuple[float, ...]] = None
    name: str = ""

    @property
    def scalar(self) -> bool:
        """A dense input of the model; else the ids of a table of its own (``hybridrec.data.numeric``)."""
        return self.encoding == "scalar"

    @property
    def table_name(self) -> str:
        return f"t_{self.name}"


@dataclass(frozen=True)
class _Sparse:
    index: int
    name: str
    column: str
    num_embeddings: int
    table: Optional[str]
    pooling: str
    weights_column: Optional[str]
    max_length: Optional[int]
    truncate: bool
    id_mapping: str
    vocabulary: Optional[str]
    null_ids: str = "empty"

    @property
    def table_name(self) -> str:
        return self.table if self.table else f"t_{self.name}"


def _sparse_list(sparse: Any) -> list[_Sparse]:
    out = []
    for i, f in enumerate(_plain(sparse) or []):
        out.append(
            _Sparse(
                i,
                f["name"],
                f["column"],
                int(f["num_embeddings"]),
                f.get("table"),
                f.get("pooling") or "sum",
                f.get("weights_column"),
                f.get("max_length"),
                bool(f.get("truncate", False)),
                f.get("id_mapping") or "none",
                f.get("vocabulary"),
                f.get("null_ids") or "empty",
            )
        )
    return out


def _dense_list(dense: Any, encoding: Any = "scalar", buckets: int = 16) -> list[_Dense]:
    """The dense entries, each entry's unset encoding and buckets the data config's
    (``numeric_encoding``, ``numeric_buckets``)."""
    out = []
    for d in _plain(dense) or []:
        knots = d.get("knots")
        out.append(
            _Dense(
                d["column"],
                d.get("transform") or "none",
                d.get("mean"),
                d.get("std"),
                d.get("encoding") or _value(encoding) or "scalar",
                int(d["buckets"] if d.get("buckets") is not None else buckets),
                tuple(float(k) for k in knots) if knots is not None else None,
                d.get("name") or f"num_{d['column']}",
            )
        )
    return out
