"""Tracing: typed events, sinks (null by default, bounded in memory), report and prediction tools."""

from tracing.sink import NULL_SINK, MemorySink, NullSink, TraceSink

__all__ = ["NULL_SINK", "MemorySink", "NullSink", "TraceSink"]
