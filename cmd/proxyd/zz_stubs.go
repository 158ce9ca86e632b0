package main

import "context"

func cmdDemo(ctx context.Context, args []string, io stdio) int { return 1 }
func cmdPool(ctx context.Context, args []string, io stdio) int { return 1 }
