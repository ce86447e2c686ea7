// The series store lives in store/ (namespace foreshock::store); the server
// refers to it by these names.
#pragma once

#include "store/series_store.h"

namespace foreshock::server {

using store::InMemorySeriesStore;
using store::KeyedPoint;
using store::Point;
using store::SeriesKey;
using store::SeriesKeyHash;
using store::SeriesStore;

}  // namespace foreshock::server
