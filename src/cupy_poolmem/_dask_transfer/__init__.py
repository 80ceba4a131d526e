"""Same-host transfers of CuPy chunks between Dask workers through pool IPC.

When a worker sends a CuPy array that lives on an IPC-enabled cupy_poolmem pool to
another worker of the same host, only a small header travels over the worker's
comm: the sharing :class:`~cupy_poolmem._sharing._wire.Descriptor` of the block
(its ticket registered with this process's exporter, as for any shared array).  The
receiving worker maps the block through the sharing importer: on the same GPU the
received chunk is a zero-copy view; on another GPU it is copied once, device to
device, into the receiver's own pool, and the mapping is let go at once.  The
sharing lifetime protocol (tickets, leases, limbo, the exit wait) keeps the block
alive until the receiver is done with it.

How it hooks into distributed (no patched copy of it):

* **Serializer.**  The ``"dask"`` serialization family's ``cupy.ndarray`` entry
  (``dask_serialize`` / ``dask_deserialize``, registered by
  ``distributed.protocol.cupy``) is wrapped: the original is captured and everything
  that does not take the IPC path is handed to it unchanged.  That family is what a
  worker's ``get_data`` uses over TCP (workers have no ``serializers`` of their own,
  so ``("dask", "pickle")``).  A new serialization family was the alternative; it
  would only be used where every worker, client and scheduler lists it in its
  ``serializers``, which a plugin registered after start-up cannot arrange.
* **Handshake.**  ``dask_serialize`` functions that take a ``context`` get the
  comm's ``context`` (``distributed.comm.tcp.TCP.write``), whose ``"recipient"`` is
  the handshake the peer sent when the comm was made.  A worker with this path
  installed adds an identity entry to its outgoing handshakes
  (``worker.connection_args["handshake_overrides"]``): a worker fetching data
  connects to the worker that has it, so the sender sees the receiver's identity.
  The sender takes the IPC path only for a recipient on the same boot (same
  ``/proc/sys/kernel/random/boot_id``), same user, same sharing key (the sharing
  connections authenticate with the multiprocessing authkey of the process family,
  or with a key derived from a per-host secret file: ``_secret``), same protocol
  version, that can see the chunk's GPU; anything else - the client, the scheduler,
  another host, a worker without the plugin, spilling to disk (no context) - gets
  Dask's own serialization.  Comms made before the path was installed carry no
  identity and keep falling back until they close.
* **Failures.**  A receiver that cannot map a block asks the sender again, through
  a handler the path adds to the sending worker (``cupy_poolmem_refetch``), for the
  same chunk through Dask's own serialization: the sender holds its data until the
  receiver has answered ``get_data``, so the block is still there.  Only when that
  fails too is :class:`~cupy_poolmem.TransferError` (a :class:`ConnectionError`)
  raised, which Dask handles as an unreachable sender.

* **Meeting.**  Once registered, a worker meets the same-host workers already
  running (``_warm``): both map a block of each other's pools, so connections and
  pool imports are paid when workers meet, not by the first chunk.

Parts, one file each: ``_protocol`` (the names and version both ends agree on),
``_config`` (:class:`TransferConfig`, Dask's config section), ``_identity`` (the
handshake entry), ``_secret`` (the per-host secret file), ``_decide`` (IPC or the
reason to fall back), ``_header`` (the chunk's sub-header), ``_process`` (the
process's state and counters: their one owner), ``_sender`` and ``_receiver`` (the
two serializer wrappers and the two ends of the refetch), ``_warm`` (meeting the
peers), ``_steps`` (the GPU and sharing steps, loaded by ``install`` only),
``_install`` (on a worker, and off again).  One worker per process (as dask-cuda
runs them): the state is the process's, read with ``_process.state()`` at call
time; its ``gpu`` steps are the collaborator a test replaces.

This package is an integration leaf: the core never imports it.
"""

from __future__ import annotations

from ._config import CONFIG_DEFAULTS, CONFIG_KEY, TransferConfig
from ._decide import REASONS, decide, peer_reason
from ._header import make_header, parse_header
from ._identity import boot_id, check_identity, local_identity
from ._install import install, uninstall
from ._process import Counters, counters
from ._protocol import HANDSHAKE_KEY, HEADER_KEY, PROTOCOL, REFETCH_OP, WARM_OP
from ._receiver import deserialize
from ._sender import serialize

__all__ = [
    "CONFIG_DEFAULTS",
    "CONFIG_KEY",
    "HANDSHAKE_KEY",
    "HEADER_KEY",
    "PROTOCOL",
    "REASONS",
    "REFETCH_OP",
    "WARM_OP",
    "Counters",
    "TransferConfig",
    "boot_id",
    "check_identity",
    "counters",
    "decide",
    "deserialize",
    "install",
    "local_identity",
    "make_header",
    "parse_header",
    "peer_reason",
    "serialize",
    "uninstall",
]
