from kvspec.cli import main

main()
