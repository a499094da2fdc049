"""What a run reports: step metrics, profiles, start-up time, router load, indexer metrics."""
