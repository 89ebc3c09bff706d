"""What a call did, read off its timeline (no torch).

- ``timeline``: the executed timeline: spans, Chrome trace, utilisation, bubble, ASCII;
- ``timeline_svg``: the timeline as an SVG picture;
- ``perf_counters``: PopTorch's ``getPerfCounters`` and latencies.
"""
