"""A separate serving process for the Redis bus test: follows the registry and prints every change.

Usage: python redis_subscriber.py DB_URL DATA_DIR REDIS_URL CHANNEL CLIENT_NAME
Prints one JSON line per change ({"name", "digest", "resyncs"}), after {"ready": true}; exits on EOF.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lora_registry.follower import RegistryFollower
from lora_registry.redis_bus import RedisEventBus
from lora_registry.registry import open_registry
from lora_registry.schemas import ActiveAdapter
from lora_registry.settings import RegistrySettings


def main() -> None:
    db_url, data_dir, redis_url, channel, client_name = sys.argv[1:6]
    settings = RegistrySettings(Path(data_dir), db_url, redis_url=redis_url, redis_channel=channel)
    bus = RedisEventBus(redis_url, channel, retry_delay=1.5, client_name=client_name)
    registry = open_registry(settings, bus=bus, auto_upgrade=False)
    follower: RegistryFollower

    def changed(name: str, adapter: ActiveAdapter | None) -> None:
        line = {"name": name, "digest": adapter.digest if adapter else None, "resyncs": follower.resyncs}
        print(json.dumps(line), flush=True)

    follower = RegistryFollower(registry.adapters, bus, changed).start()
    assert bus._subs[0].wait_connected(10)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    follower.close()
    registry.close()


if __name__ == "__main__":
    main()
