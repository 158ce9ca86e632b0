package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Route templates of the 20 endpoints of the provider API, as reported to
// Config.Observe and in errors.
const (
	RouteClients         = "/api/clients"
	RouteStats           = "/api/stats/{id}"
	RouteRate            = "/api/rate/{id}"
	RouteProduct         = "/api/product/{pid}" // GET: product; POST: order
	RouteProducts        = "/api/products"
	RouteProductsOrderBy = "/api/products/orderby/{field}"
	RouteNetworkErrors   = "/api/networkstatus/errors/{id}"
	RouteNetworkInactive = "/api/networkstatus/inactive/{id}"
	RouteCredit          = "/api/billing/credit"
	RouteInvoices        = "/api/billing/invoices"
	RouteInvoice         = "/api/billing/invoice/{id}"
	RouteService         = "/api/service/{id}" // GET: service; PUT: update
	RouteServices        = "/api/services"
	RouteIPList          = "/api/iplist/{typel}/{formatl}/{id}"
	RouteStickyList      = "/api/sticky/list/{id}"
	RouteStickyRotate    = "/api/sticky/rotate/{id}/{server}/{session}"
	RouteStickyChangeTTL = "/api/sticky/changettl/{id}/{ttl}"
	RouteStickyResetAll  = "/api/sticky/resetall/{id}"
)

func itoa(i int) string { return strconv.Itoa(i) }

// call sends one request and decodes the answer with dec, wrapping a decode
// failure in a *DecodeError naming the route. What dec returns with its
// error is passed on (an IPList or StickyList keeps Raw and BadLines).
func call[T any](ctx context.Context, c *Client, method, route string, args []string, body any, dec func([]byte) (T, error)) (T, error) {
	raw, err := c.Call(ctx, method, route, args, body)
	if err != nil {
		var zero T
		return zero, err
	}
	return decode(c, route, raw, dec)
}

// change is call for an endpoint that changes the account (a service
// update, the sticky calls 18–20, which use GET). A 2xx answer
// whose body is the provider's error object fails as the *APIError of
// refusal, with the provider's message; actions are the keys of an
// answer given per action, whose own error objects count too. A refused
// answer is decoded as well, as far as it can be, and returned with the
// error: one action refused does not say that the others were not made.
func change[T any](ctx context.Context, c *Client, method, route string, args []string, body any, dec func([]byte) (T, error), actions ...string) (T, error) {
	status, raw, err := c.request(ctx, method, route, args, body)
	if err != nil {
		var zero T
		return zero, err
	}
	if refused := refusal(status, route, raw, actions...); refused != nil {
		refused.Method = method
		c.redact(refused, raw)
		// What the rest of the answer says, without the credentials: a
		// key they would be part of is lost, a refusal never is.
		v, _ := dec(c.scrub(raw))
		return v, refused
	}
	return decode(c, route, raw, dec)
}

// decode reads the 2xx answer raw of route with dec, wrapping a failure
// in a *DecodeError naming the route.
func decode[T any](c *Client, route string, raw []byte, dec func([]byte) (T, error)) (T, error) {
	v, err := dec(raw)
	if err != nil {
		return v, c.decodeError(route, raw, err)
	}
	return v, nil
}

// get is call for a GET endpoint without a body.
func get[T any](ctx context.Context, c *Client, route string, dec func([]byte) (T, error), args ...string) (T, error) {
	return call(ctx, c, http.MethodGet, route, args, nil, dec)
}

func object[T any](known ...string) func([]byte) (*T, error) {
	return func(b []byte) (*T, error) {
		v := new(T)
		if err := decodeObject(b, v, known...); err != nil {
			return nil, err
		}
		return v, nil
	}
}

// Clients lists the clients of the account (endpoint 1).
func (c *Client) Clients(ctx context.Context) ([]ClientRecord, error) {
	return get(ctx, c, RouteClients, decodeList[ClientRecord])
}

// Stats returns the usage statistics of a ppr service (endpoint 2).
func (c *Client) Stats(ctx context.Context, id int) ([]StatsItem, error) {
	return get(ctx, c, RouteStats, decodeList[StatsItem], itoa(id))
}

// Rate returns the usage and limit of a ppr service (endpoint 3).
func (c *Client) Rate(ctx context.Context, id int) ([]RateItem, error) {
	return get(ctx, c, RouteRate, decodeList[RateItem], itoa(id))
}

// Product returns one product (endpoint 4).
func (c *Client) Product(ctx context.Context, pid int) (*Product, error) {
	return get(ctx, c, RouteProduct, object[Product]("productId", "productName", "product_type", "price"), itoa(pid))
}

// Order orders a new service of product pid for a client, paid from the
// credit (endpoint 5).
func (c *Client) Order(ctx context.Context, pid int, o OrderRequest) (*OrderResult, error) {
	// Not change: an order answer that carries its service or invoice next
	// to an error string may have been placed and paid; taken for a
	// refusal, it could be ordered twice.
	return call(ctx, c, http.MethodPost, RouteProduct, []string{itoa(pid)}, o, object[OrderResult]("serviceId", "orderId", "invoiceId"))
}

// Products lists the products (endpoint 6).
func (c *Client) Products(ctx context.Context) ([]ProductItem, error) {
	return get(ctx, c, RouteProducts, decodeList[ProductItem])
}

// ProductsOrderBy lists the products ordered by field: productId,
// productName, price, groupId, groupName or created_at (endpoint 7).
func (c *Client) ProductsOrderBy(ctx context.Context, field string) ([]ProductItem, error) {
	return get(ctx, c, RouteProductsOrderBy, decodeList[ProductItem], field)
}

// NetworkErrors lists the IPs of the service's proxy servers that have
// errors (endpoint 8).
func (c *Client) NetworkErrors(ctx context.Context, id int) ([]string, error) {
	return get(ctx, c, RouteNetworkErrors, decodeIPs, itoa(id))
}

// NetworkInactive lists the IPs of the service's inactive proxy servers
// (endpoint 9).
func (c *Client) NetworkInactive(ctx context.Context, id int) ([]string, error) {
	return get(ctx, c, RouteNetworkInactive, decodeIPs, itoa(id))
}

// decodeIPs reads a list of IP addresses: strings, numbers' text, or
// objects carrying the address under ip/host/address.
func decodeIPs(body []byte) ([]string, error) {
	elems, err := decodeArray(body)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(elems))
	for i, raw := range elems {
		raw = bytes.TrimSpace(raw)
		if len(raw) > 0 && raw[0] == '{' {
			var obj map[string]json.RawMessage
			if err := json.Unmarshal(raw, &obj); err != nil {
				return nil, fmt.Errorf("element %d: %w", i, err)
			}
			found := false
			for _, k := range []string{"ip", "host", "address"} {
				if v, ok := lookupFold(obj, k); ok {
					if ip, err := parseText(v); err == nil && ip != "" {
						out = append(out, ip)
						found = true
						break
					}
				}
			}
			if !found {
				return nil, fmt.Errorf("element %d: no ip field", i)
			}
			continue
		}
		var ip string
		if err := json.Unmarshal(raw, &ip); err != nil {
			return nil, fmt.Errorf("element %d: not an address: %w", i, err)
		}
		if ip = strings.TrimSpace(ip); ip != "" {
			out = append(out, ip)
		}
	}
	return out, nil
}

// Credit returns the account credit in USD (endpoint 10).
func (c *Client) Credit(ctx context.Context) (float64, error) {
	return get(ctx, c, RouteCredit, func(b []byte) (float64, error) {
		var w struct {
			Credit Number `json:"credit"`
		}
		if err := decodeObject(b, &w, "credit"); err != nil {
			return 0, err
		}
		return float64(w.Credit), nil
	})
}

// Invoices lists the invoices (endpoint 11).
func (c *Client) Invoices(ctx context.Context) ([]Invoice, error) {
	return get(ctx, c, RouteInvoices, decodeList[Invoice])
}

// Invoice returns one invoice, in the list form the provider uses
// (endpoint 12): empty when it does not exist.
func (c *Client) Invoice(ctx context.Context, id int) ([]Invoice, error) {
	return get(ctx, c, RouteInvoice, func(b []byte) ([]Invoice, error) {
		if t := bytes.TrimSpace(b); len(t) > 0 && t[0] == '{' {
			var one Invoice
			if err := decodeObject(t, &one, "id", "status", "amount"); err == nil {
				return []Invoice{one}, nil
			}
		}
		return decodeList[Invoice](b)
	}, itoa(id))
}

// Service returns one service (endpoint 13).
func (c *Client) Service(ctx context.Context, id int) (*Service, error) {
	return get(ctx, c, RouteService, object[Service]("service_id", "status", "product_type", "username"), itoa(id))
}

// Services lists the services of the account (endpoint 14).
func (c *Client) Services(ctx context.Context) ([]ServiceItem, error) {
	return get(ctx, c, RouteServices, decodeList[ServiceItem])
}

// UpdateService binds an IP, requests a new IP list and/or changes the
// password of a service (endpoint 15). A repeated list update before the
// allowed time fails with ErrTooManyAttempts; the *APIError carries
// NextAllowed. A 200 answer with an {"error": "..."}, at the top or under
// an action, fails too (refusal), and still returns what the answer says
// of each action: the others may have been made.
func (c *Client) UpdateService(ctx context.Context, id int, u ServiceUpdate) (ServiceUpdateResult, error) {
	return change(ctx, c, http.MethodPut, RouteService, []string{itoa(id)}, u, decodeUpdateResult, "setip", "update_list", "password")
}

// decodeUpdateResult reads {"action": {"success": "message"}}; a bare
// string is kept as the message, and so is an action's "error" that is
// blank or no string (a message there has failed the call: refusal).
func decodeUpdateResult(body []byte) (ServiceUpdateResult, error) {
	res := ServiceUpdateResult{}
	t := bytes.TrimSpace(body)
	if len(t) == 0 || string(t) == "null" || string(t) == "[]" {
		return res, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(t, &obj); err != nil {
		return nil, err
	}
	for _, k := range sortedKeys(obj) {
		v := bytes.TrimSpace(obj[k])
		if len(v) > 0 && v[0] == '{' {
			var inner map[string]json.RawMessage
			if err := json.Unmarshal(v, &inner); err != nil {
				return nil, fmt.Errorf("action %q: %w", k, err)
			}
			msg := ""
			for _, mk := range []string{"success", "error", "message"} {
				if m, ok := lookupFold(inner, mk); ok {
					if s, err := parseText(m); err == nil {
						msg = s
						break
					}
				}
			}
			res[k] = msg
			continue
		}
		s, err := parseText(v)
		if err != nil {
			return nil, fmt.Errorf("action %q: %w", k, err)
		}
		res[k] = s
	}
	return res, nil
}

// IPList downloads and parses the IP list of a service (endpoint 16); typ
// is one of http-ip, socks-ip, http-auth, ppr-http, ppr-socks; format one of
// txt, csv, json. Bad lines are counted
// in the result; an error is returned only when nothing could be read from
// a non-empty body (with the list, so BadLines can be shown).
func (c *Client) IPList(ctx context.Context, id int, typ, format string) (*IPList, error) {
	if !validFormat(format) {
		return nil, fmt.Errorf("requesting ip list: unknown format %q (want txt, csv or json)", format)
	}
	return get(ctx, c, RouteIPList, func(b []byte) (*IPList, error) { return ParseIPList(b, format) }, typ, format, itoa(id))
}

// StickyList lists the sticky sessions of a ppr service (endpoint 17).
func (c *Client) StickyList(ctx context.Context, id int) (*StickyList, error) {
	return get(ctx, c, RouteStickyList, ParseStickyList, itoa(id))
}

// StickyRotate gives a sticky session a new exit IP (endpoint 18).
func (c *Client) StickyRotate(ctx context.Context, id int, server, session string) (*StickyResult, error) {
	if server == "" || session == "" {
		return nil, errors.New("rotating sticky session: server and session must not be empty")
	}
	return c.sticky(ctx, RouteStickyRotate, itoa(id), server, session)
}

// StickyChangeTTL sets the sticky session TTL of a ppr service in minutes,
// one of 1, 2, 3, 5, 10, 15; the provider refuses others with 422 (endpoint 19).
func (c *Client) StickyChangeTTL(ctx context.Context, id int, ttl int) (*StickyResult, error) {
	return c.sticky(ctx, RouteStickyChangeTTL, itoa(id), itoa(ttl))
}

// StickyResetAll resets all sticky sessions of a ppr service (endpoint 20).
func (c *Client) StickyResetAll(ctx context.Context, id int) (*StickyResult, error) {
	return c.sticky(ctx, RouteStickyResetAll, itoa(id))
}

// sticky sends one of the sticky calls that change state (endpoints
// 18–20). Their success bodies are not public: anything but the
// provider's error object is a success (refusal).
func (c *Client) sticky(ctx context.Context, route string, args ...string) (*StickyResult, error) {
	return change(ctx, c, http.MethodGet, route, args, nil, func(b []byte) (*StickyResult, error) {
		return &StickyResult{Raw: b, ExitIP: findExitIP(b)}, nil
	})
}

func validFormat(f string) bool { return f == "txt" || f == "csv" || f == "json" }
