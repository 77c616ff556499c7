"""The frozen target: finding and loading it, sharding it over processes, its offline cache, the demo target."""
