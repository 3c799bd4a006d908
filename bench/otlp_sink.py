#!/usr/bin/env python3
"""A minimal OTLP/gRPC trace receiver for benchmarks: accepts every export, counts spans.

Used to measure what trace export costs Baton with a collector that answers (see
docs/benchmarks.md, "Observability overhead"). Needs `grpcio` and `opentelemetry-proto` from PyPI:

    python3 -m venv /tmp/otlp-sink && /tmp/otlp-sink/bin/pip install grpcio opentelemetry-proto
    /tmp/otlp-sink/bin/python bench/otlp_sink.py --port 4317

Prints the span count every few seconds on stderr.
"""

import argparse
import sys
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans = 0
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self.lock:
            self.spans += n
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=4317)
    args = ap.parse_args()
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(f"otlp sink on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(5)
            print(f"spans received: {sink.spans}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        server.stop(0)


if __name__ == "__main__":
    main()
