"""The parts of ``benchmarks/rag_serving.py`` (modules, not commands): ``workload`` (documents,
requests, arrivals) and ``report`` (each point's row, the summary, the table, the plots)."""
