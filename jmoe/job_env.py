"""The environment variables that make processes one job (set by `python -m jmoe.launch`, or by hand
on each host): names only, so the launcher starts without importing jax."""

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JMOE_COORDINATOR", "JMOE_NUM_PROCESSES", "JMOE_PROCESS_ID"
ENV_LOCAL_DEVICES = "JMOE_LOCAL_DEVICES"  # CPU devices per process (XLA:CPU has one unless told)
ENV_PEER_TIMEOUT = "JMOE_PEER_TIMEOUT"  # seconds without a peer's heartbeat before stopping
