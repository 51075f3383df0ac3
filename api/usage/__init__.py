"""Usage accounting: every finished request becomes a `UsageEntry`, written in batches by a background
thread (`recorder.UsageRecorder`); `service.UsageLimits` wires accounting and rate limits into a server.
"""
