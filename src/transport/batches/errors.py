"""Exceptions shared by every batch transport."""

from __future__ import annotations


class TransportClosed(Exception):
    """The other side closed the transport on purpose: for the trainer, the orchestrator has
    finished sending batches; for the orchestrator, the trainer has stopped receiving. A clean
    end of the run, not a failure."""
