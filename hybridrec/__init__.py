"""hybridrec: TorchRec-sharded embeddings + FSDP2 dense layers, composed by Hydra."""

__version__ = "0.1.0"
