"""Observability of the pools: tags, scoped statistics, outstanding allocations, the
allocation log and its writer thread, and the recorder's configuration.

The public face is :mod:`cupy_poolmem.stats`; the modules here import nothing of the
package above the floor (``_runtime``, loaded late for the base install).
"""
