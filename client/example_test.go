// SPDX-License-Identifier: Apache-2.0

package client_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// serve starts a permit server with a flights pool of 2 and a residents pool
// of 2, as the daemon would, and returns its socket and a stop function.
func serve() (string, func()) {
	dir, err := os.MkdirTemp("", "permits")
	if err != nil {
		log.Fatal(err)
	}
	flights, _ := pools.New(pools.Config{Name: "flights", Size: 2}, nil)
	residents, _ := pools.NewResidents(pools.Config{Name: "residents", Size: 2}, nil)
	sock := filepath.Join(dir, "permits.sock")
	srv, err := permitd.New(permitd.Config{Socket: sock}, map[string]*pools.Pool{"flights": flights}, residents, nil)
	if err != nil {
		log.Fatal(err)
	}
	if err := srv.Listen(); err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { srv.Serve(ctx); close(done) }()
	return sock, func() { cancel(); <-done; os.RemoveAll(dir) }
}

// A runtime wraps each store call in a flight lease and backs off for as
// long as the refusal says.
func Example_flights() {
	sock, stop := serve()
	defer stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{Socket: sock})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	var held []client.Lease
	for i := 0; i < 3; i++ {
		l, err := c.Acquire(ctx, "flights", "shop")
		var pe *client.Error
		if errors.As(err, &pe) && errors.Is(err, client.ErrRefused) {
			fmt.Printf("call %d refused, retry after > 0: %v\n", i, pe.RetryAfter > 0)
			continue
		}
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("call %d in flight\n", i)
		held = append(held, l)
	}
	for _, l := range held {
		released, _ := c.Release(ctx, l)
		fmt.Println("released:", released)
	}
	again, _ := c.Release(ctx, held[0])
	fmt.Println("released twice:", again)
	// Output:
	// call 0 in flight
	// call 1 in flight
	// call 2 refused, retry after > 0: true
	// released: true
	// released: true
	// released twice: false
}

// A runtime keeps objects resident. When the pool is full a spawn waits
// while the daemon has the owner of the idlest object put it to sleep.
func Example_residents() {
	sock, stop := serve()
	defer stop()
	ctx := context.Background()
	c, err := client.Dial(ctx, client.Options{
		Socket: sock,
		OnEvict: func(ev client.Eviction) error {
			// Ship the object's state to disk here, then return nil.
			fmt.Printf("put %s to sleep (%s)\n", ev.Object, ev.Reason)
			return nil
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	for _, o := range []string{"cart-1", "cart-2"} {
		if _, err := c.Spawn(ctx, "shop", o); err != nil {
			log.Fatal(err)
		}
	}
	c.Touch(ctx, "cart-1") // cart-2 is now the idlest
	if _, err := c.Spawn(ctx, "shop", "cart-3"); err != nil {
		log.Fatal(err)
	}
	fmt.Println("cart-3 resident")
	// Output:
	// put cart-2 to sleep (own-idlest)
	// cart-3 resident
}
