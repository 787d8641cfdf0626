"""The traffic loop's server side: online experiments (shadow runs, interleaving) and promotion."""
