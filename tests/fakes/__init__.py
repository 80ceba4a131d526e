"""Fakes the CPU tests drive the package against, one module per domain: the driver
seam (``driver``: the ``fake_driver`` fixture, ``PassThrough``, pointer attributes), the
hot path's driver (``hotpath``), CUDA events (``events``), virtual memory management
(``vmm``), managed memory (``managed``), cuda.core's memory resources (``resources``),
mapped and expandable pools (``mapped``, ``expandable``), the guard's fills (``guard``),
the observer's hot path (``observer``), processes sharing pools (``sharing``)."""
