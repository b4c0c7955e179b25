"""The rollout side: SGLang servers (lifecycle, HTTP surface), the client (admission, retries, stall
watchdog), typed rollout records, and the fleet the training loop calls (generate, push, evaluate)."""
