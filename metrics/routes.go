package metrics

import (
	"slices"
	"strings"

	"github.com/proxyd/proxyd/agent"
)

// APIRoutes are the route templates of the provider API, the values of the
// endpoint label of proxyd_api_requests_total and proxyd_api_request_seconds:
// a template such as /api/iplist/{typel}/{formatl}/{id}, never a filled-in
// path, so the label stays bounded. They are the agent's, as it reports them
// to its Observe hook. The 20 endpoints have 18 templates: GET and POST
// /api/product/{pid}, and GET and PUT /api/service/{id}, share theirs.
func APIRoutes() []string {
	return []string{
		agent.RouteClients,
		agent.RouteStats,
		agent.RouteRate,
		agent.RouteProduct,
		agent.RouteProducts,
		agent.RouteProductsOrderBy,
		agent.RouteNetworkErrors,
		agent.RouteNetworkInactive,
		agent.RouteCredit,
		agent.RouteInvoices,
		agent.RouteInvoice,
		agent.RouteService,
		agent.RouteServices,
		agent.RouteIPList,
		agent.RouteStickyList,
		agent.RouteStickyRotate,
		agent.RouteStickyChangeTTL,
		agent.RouteStickyResetAll,
	}
}

// OtherRoute is the endpoint label value for a route that is not one of
// APIRoutes: a filled-in path must never become a label value.
const OtherRoute = "other"

// requestResults are the outcomes of a request proxyd makes of the provider
// on its own initiative (a sticky rotation, a fresh IP list): it succeeded,
// failed, or was refused with 429 for now.
var requestResults = [...]string{"ok", "error", "rate_limited"}

// RotationResults are the result label values of
// proxyd_sticky_rotations_total.
func RotationResults() []string { return slices.Clone(requestResults[:]) }

// ListUpdateResults are the result label values of proxyd_list_updates_total.
func ListUpdateResults() []string { return slices.Clone(requestResults[:]) }

// requestResult maps result to its index in requestResults and its label
// value: anything that is not a known result is an error.
func requestResult(result string) (int, string) {
	if i := slices.Index(requestResults[:], result); i >= 0 {
		return i, result
	}
	return slices.Index(requestResults[:], "error"), "error"
}

// normalizeRoute maps route to its label value: an optional method prefix
// ("GET /api/...") is dropped, and anything that is not a known template
// becomes OtherRoute.
func normalizeRoute(route string) string {
	if i := strings.IndexByte(route, ' '); i >= 0 {
		route = strings.TrimSpace(route[i+1:])
	}
	if slices.Contains(APIRoutes(), route) {
		return route
	}
	return OtherRoute
}

// normalizeCode keeps a three-digit HTTP status and turns anything else into
// "error", the code label value of a request that got no answer.
func normalizeCode(code string) string {
	if len(code) == 3 && code[0] >= '1' && code[0] <= '5' &&
		code[1] >= '0' && code[1] <= '9' && code[2] >= '0' && code[2] <= '9' {
		return code
	}
	return "error"
}
