"""Token trees: their layouts, the policy that shapes each round's tree, and their verification."""
