"""Expert parallelism over torch.distributed: the head (rank 0) runs the model and sends each MoE
layer's rows to the ranks that own the routed experts; every rank reads its own share of the
experts from its own disk (docs/distributed.md).

    config      ClusterConfig (from torchrun's env:// variables), in latentkv.config
    rendezvous  the store, start-up and rejoin handshakes, one gloo group per epoch
    handshake   what a rank tells the head at start-up, and the head's verdict
    wire        the messages of one head-worker link (headers, rows, outputs)
    worker      a worker rank: its share's streamer, the loop that serves the head's jobs
    head        the head's view of the cluster: jobs out, outputs back, faults, telemetry
    store       RemoteExperts: the ExpertStore of one MoE layer whose experts live on the ranks

It sits above `streaming` (it opens streamed stores and plans ranks) and below `runtime`, which
loads a model with a RemoteExperts store in every MoE layer when started under torchrun.
"""
