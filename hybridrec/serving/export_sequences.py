"""The export of a sequence ranker (SASRec, HSTU): what retrieval serves.

``python -m hybridrec.export checkpoint=<a sequence model's checkpoint>`` writes:

- ``model.pt2``: the user encoder as a ``torch.export`` program,
  ``program(history, lengths, times) -> [B, D]`` user vectors (``UserEncoder``);
- ``item_vectors.pt``: ``{"item_ids": [N-1], "vectors": [N-1, D]}``, every item's vector,
  tensors only (``torch.load(path, weights_only=True)``);
- ``model.json``: the inputs, and how to score: ``user @ vectors.T``, the top k by
  ``torch.topk``; the index of a vector is that of its id in ``item_ids``.

A user's top 10, with torch alone::

    encoder = torch.export.load("model.pt2").module()
    items = torch.load("item_vectors.pt", weights_only=True)
    history = torch.zeros(1, max_length, dtype=torch.long); history[0, :3] = torch.tensor([50, 172, 133])
    user = encoder(history, torch.tensor([3]), torch.zeros(1, max_length, dtype=torch.long))
    top = torch.topk(user @ items["vectors"].T, 10).indices[0]
    print(items["item_ids"][top])   # the 10 items ranked first, best first

The exported scores are the model's own: ranking the catalogue with them gives the ranks
evaluation reports (tests/test_sequences.py).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from hybridrec.base.compat import size_oblivious_export
from hybridrec.models.sequential import SequenceRanker

PROGRAM, ITEMS = "model.pt2", "item_vectors.pt"


def write_user_encoder(
    model: SequenceRanker, out: str, about: dict[str, Any], write: Callable[[str, Callable[[str], Any]], None]
) -> dict[str, Any]:
    """``model.pt2`` (the user encoder) and ``item_vectors.pt`` in ``out``, through ``write``
    (the export's file writer); returns ``model.json``'s content."""
    length = model.max_length
    encoder = model.encoder().eval()
    example = (
        torch.ones(2, length, dtype=torch.int64),
        torch.full((2,), length, dtype=torch.int64),
        torch.zeros(2, length, dtype=torch.int64),
    )
    batch = torch.export.Dim("batch")
    with torch.no_grad(), size_oblivious_export():
        program = torch.export.export(
            encoder, example, dynamic_shapes=({0: batch}, {0: batch}, {0: batch}), strict=False
        )
    write(os.path.join(out, PROGRAM), lambda path: torch.export.save(program, path))
    vectors = model.item_vectors().contiguous()
    ids = torch.arange(1, len(vectors) + 1, dtype=torch.int64)
    write(os.path.join(out, ITEMS), lambda path: torch.save({"item_ids": ids, "vectors": vectors}, path))
    return {
        "program": PROGRAM,
        "load": "torch.export.load(path).module()",
        "kind": "user encoder of a sequence ranker (retrieval): score every item by user @ vectors.T",
        "inputs": {
            "history": {
                "dtype": "int64",
                "shape": ["B", length],
                "doc": "each row's items, oldest first, then 0 up to max_length (the most recent "
                f"{length} when a history is longer)",
            },
            "lengths": {"dtype": "int64", "shape": ["B"], "doc": "items in each row's history (>= 1)"},
            "times": {
                "dtype": "int64",
                "shape": ["B", length],
                "doc": "each history item's timestamp (HSTU's time bias), 0 after the history; zeros for SASRec",
            },
        },
        "output": "user vectors [B, D] float32",
        "item_vectors": ITEMS,
        "item_vectors_doc": "item_ids [N-1] int64 and vectors [N-1, D] float32: scores = user @ vectors.T, "
        "top k = item_ids[torch.topk(scores, k).indices]",
        "max_length": length,
        "catalogue": len(vectors),
        **about,
    }
