"""megatron_sparseloco — communication-efficient outer steps for Megatron pretraining.

Layering (each layer imports only the ones before it):

    compress  → pure-torch codec: chunked Top-k, n-bit quantiser, bit-packed wire format, error feedback
    comm      → collectives over any torch.distributed group, with exact byte accounting
    outer     → outer optimisers (model averaging, DiLoCo, SparseLoCo, GASLoC) on flat fp32 shards
    megatron  → megatron-core / megatron.training integration: optimizer wrapper, flags, checkpoints

``megatron_sparseloco.testing`` holds the multi-rank CPU harness and the CPU bridges for
megatron-core; the production path never imports it.
"""

__version__ = "0.1.0"
