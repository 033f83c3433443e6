from corrallm.cli import main

main()
