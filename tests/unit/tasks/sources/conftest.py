from source_fixtures import minicalc_repo  # noqa: F401  (fixtures shared by this dir's tests)
