import sys

# The fake backend is spawned often (tests, demo, benchmarks): skip the CLI's imports.
if len(sys.argv) > 1 and sys.argv[1] == "fake-backend":
    from corrallm.fake_backend import main as fake_main

    fake_main(sys.argv[2:])
else:
    from corrallm.cli import main

    main()
