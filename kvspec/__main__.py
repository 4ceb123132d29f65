from kvspec.hashseed import pin_hash_seed

pin_hash_seed()  # before anything heavy is imported: the process may start again

from kvspec.cli import main  # noqa: E402

main()
