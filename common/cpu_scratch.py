"""MXNet's CPU scratch buffers: how many a run needs. MXNet reads MXNET_CPU_TEMP_COPY once, when it starts, and
hands its ops their temporary space (a convolution's im2col, a reduction's workspace) round robin from that many
copies, one pool for every CPU context; two ops given the same copy wait for each other.

- Any run: 16 copies per context, so that two contexts' convolutions overlap instead of taking turns
  (docs/profiling.md); MXNet's default is 4.
- Gluon's contrib SyncBatchNorm on CPU contexts: each context's op waits inside the layer until every context has
  brought its moments. If it holds a copy that an op upstream on another context needs, that op never runs and the
  run hangs. Every op of the forward and backward needs a copy no other context's op shares: measured with the
  ResNet-18 (tests/test_resnet_engines.py runs it), 56 copies per context hung on 8 contexts, 48 on 3 and 4, 36 on
  2; 64 ran on 2, 3, 4 and 8. 128 is twice that. Each copy in use holds its largest request: the ResNet (width 8) at batch 256
  on 2 contexts peaks at 1.6 GB with 128, against 0.6 GB for local BatchNorm with 16.
The launcher sets these before MXNet starts (harness/processes/cores.py); mxnet/builtin.py refuses a synchronised
row in one line where they were not set, instead of hanging."""
VARIABLE = "MXNET_CPU_TEMP_COPY"
MXNET_DEFAULT = 4
PER_CONTEXT = 16
SYNC_BATCHNORM_PER_CONTEXT = 128


def copies(contexts, sync_batchnorm=False):
    """The copies a process of `contexts` CPU contexts needs."""
    return (SYNC_BATCHNORM_PER_CONTEXT if sync_batchnorm else PER_CONTEXT) * contexts


def configured(environ):
    """The copies MXNet was started with (its default if the variable is unset)."""
    return int(environ.get(VARIABLE, MXNET_DEFAULT))
