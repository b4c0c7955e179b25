"""Rollouts: SGLang server lifecycle, async client, typed rollout records."""
