"""Rate limits per API key and per adapter: requests/minute, tokens/minute, concurrent requests.

`limiter.RequestLimiter` admits requests (429 over a limit); `backend.LocalLimiter` keeps the state in
the process, `redis_limiter.RedisLimiter` in Redis (shared by replicas); `headers` writes the
`x-ratelimit-*` headers. The limits themselves live in the registry (`lora_registry.limits`).
"""
