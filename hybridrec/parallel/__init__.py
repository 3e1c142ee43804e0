"""How the model is spread over devices and ranks: the device (``devices``), process groups
(``distributed``), the mesh's dimensions (``parallel_dims``), TorchRec's sharding plan for
the tables (``sharding``), the one module that applies every parallelism to a model
(``parallelize``: TorchRec's DistributedModelParallel, FSDP2, compile), and the optimizers
it applies with them (``optim``: TorchRec's fused sparse optimizers run inside the sharded
tables' backward, so they are chosen where the tables are sharded).

May import: base, config, data, models."""
