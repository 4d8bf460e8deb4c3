"""Tracing: typed events, sinks (null by default, bounded in memory), report and prediction tools."""

from tracing.sink import NULL_SINK, MemorySink, NullSink, TraceSink, sink_from_env

__all__ = ["NULL_SINK", "MemorySink", "NullSink", "TraceSink", "sink_from_env"]
