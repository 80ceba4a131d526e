"""Fakes the CPU tests drive the package against, one module per domain: the hot path's
driver (``hotpath``), CUDA events and VMM calls (``events``), the guard's fills
(``guard``), the observer's hot path (``observer``), processes sharing pools (``sharing``)."""
